"""Structured output through the services: valid answers, bounded length, alpha and the grammar's cost.

    python -m bench.structured [--reps 2] [--tokens 200] [--k 4]

`specdec up` with the embedded pair; each JSON schema below is asked for by two prompts, greedy and at T = 0.7,
in arms run one after the other within a rep: the schema as a grammar with speculation at --k, the same requests
without a grammar at --k (alpha without), the grammar at K = 0 (the target alone), and the grammar with adaptive K
(a second orchestrator on the same model servers, bench/services.py). Reported, with the spread
over reps:
  - valid: answers that end on the grammar's end (finish EOS) and parse as JSON valid against their schema, over
    those answers; finished: answers that end within --tokens; whitespace: answers holding a run of 2 or more
    whitespace characters outside strings (the compact form allows none);
  - alpha = accepted / (accepted + rounds ending in a rejection) at --k, with the grammar and without;
  - the rules' seconds on both model servers per generated token, against the target's mean one-token step
    (specdec_forward_seconds{tokens="1"}) in the same run: their work (specdec_rules_seconds_total, the masks
    included, which run beside the forward passes; the target's part apart) and what the calls waited for them
    after their passes (specdec_rules_wait_seconds_total);
  - same_text: the draft's greedy agreement with the grammar's greedy answers, teacher-forced, with its row masked
    and unmasked (alpha on the same text: the arms without a grammar answer with other text).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import grpc
import jsonschema

from bench.load import run_jobs
from bench.metrics import delta, leviathan_alpha, mean_step_s, scrape_all, value
from bench.services import machine, save, start_services, stop_services
from specdec import models
from specdec.config import DEFAULT_DRAFT
from specdec.v1 import generation_pb2 as pb, generation_pb2_grpc, model_server_pb2 as ms_pb

S = {"type": "string", "maxLength": 40}
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": S, "age": {"type": "integer", "minimum": 0}, "email": S},
        "required": ["name", "age", "email"],
    },
    "planet": {
        "type": "object",
        "properties": {"name": S, "moons": {"type": "integer"}, "gases": {"type": "array", "items": S, "maxItems": 4}},
        "required": ["name", "moons", "gases"],
    },
    "weather_call": {
        "type": "object",
        "properties": {
            "city": S,
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
        },
        "required": ["city", "unit", "days"],
    },
    "recipe": {
        "type": "object",
        "properties": {
            "title": S,
            "ingredients": {"type": "array", "items": S, "minItems": 1, "maxItems": 5},
            "minutes": {"type": "integer"},
            "vegetarian": {"type": "boolean"},
        },
        "required": ["title", "ingredients", "minutes", "vegetarian"],
    },
    "address": {
        "type": "object",
        "properties": {
            "street": S,
            "city": S,
            "country": S,
            "geo": {
                "type": "object",
                "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                "required": ["lat", "lon"],
                "additionalProperties": False,
            },
        },
        "required": ["street", "city", "country", "geo"],
    },
    "review": {
        "type": "object",
        "properties": {
            "product": S,
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "pros": {"type": "array", "items": S, "maxItems": 3},
            "cons": {"type": "array", "items": S, "maxItems": 3},
        },
        "required": ["product", "rating", "pros", "cons"],
    },
}
for _schema in SCHEMAS.values():  # strict schemas, as OpenAI's strict mode requires: no other keys in any object
    _schema["additionalProperties"] = False
PROMPTS = {
    "person": ["Make up a customer record in JSON.", "Describe the author of a famous novel as JSON."],
    "planet": ["Describe a planet of the solar system in JSON.", "Invent an ice planet and answer with JSON."],
    "weather_call": ["I need the forecast for Lisbon next week; fill in the call as JSON.", "Weather in Oslo, JSON."],
    "recipe": ["Give me a quick pasta recipe as JSON.", "A vegetarian breakfast recipe in JSON, please."],
    "address": ["Give the address of a museum in Paris as JSON.", "Where is the Sydney Opera House? Answer in JSON."],
    "review": ["Review a pair of running shoes as JSON.", "Write a JSON review of a budget laptop."],
}
# (temperature, top_p): top_p 0.9 is the gRPC API's default, 1 the HTTP API's (OpenAI's)
MODES = {"greedy": (0.0, 1.0), "t0.7": (0.7, 0.9), "t0.7-p1": (0.7, 1.0)}
WHITESPACE_RUN = re.compile(r'"(?:[^"\\]|\\.)*"|(\s{2,})')


def sender(address: str, k: int, tokens: int, temperature: float, top_p: float, grammar: bool):
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(address))

    def send(job) -> dict:
        i, (name, prompt) = job
        req = pb.GenerateRequest(max_tokens=tokens, temperature=temperature, top_p=top_p, seed=1 + i)
        req.prompt_lookup_min = 0
        if k is not None:  # None: the adaptive orchestrator chooses K round by round
            req.num_speculative_tokens = k
        req.messages.add(role="user", content=prompt)
        if grammar:
            req.grammar.CopyFrom(ms_pb.Grammar(json_schema=json.dumps(SCHEMAS[name])))
        text, ids, stats = "", [], None
        for msg in stub.Generate(req, timeout=900):
            text, ids = text + msg.text, ids + list(msg.token_ids)
            stats = msg.stats if msg.HasField("stats") else stats
        return {"name": name, "prompt": prompt, "text": text, "ids": ids, "tokens": len(ids), "stats": stats}

    return send


def judge(results: list[dict]) -> dict:
    """valid, finished and whitespace counts of one arm's answers (see the module's docstring)."""
    ended = [r for r in results if r["stats"].finish_reason == pb.FINISH_REASON_EOS_TOKEN]
    valid = 0
    for r in ended:
        try:
            jsonschema.validate(json.loads(r["text"]), SCHEMAS[r["name"]])
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    runs = sum(any(m.group(1) for m in WHITESPACE_RUN.finditer(r["text"])) for r in results)
    return {"valid": valid / max(len(ended), 1), "finished": len(ended) / len(results), "whitespace_runs": runs}


def arm(address: str, urls: dict, jobs, tokens: int, k: int, mode: str, grammar: bool) -> dict:
    temperature, top_p = MODES[mode]
    before = scrape_all(urls)
    t0 = time.perf_counter()
    results, _ = run_jobs(sender(address, k, tokens, temperature, top_p, grammar), jobs, 1)
    wall = time.perf_counter() - t0
    d = delta(before, scrape_all(urls))
    generated = sum(r["tokens"] for r in results)
    rules_s = sum(value(d, "specdec_rules_seconds_total", job=job) for job in ("draft", "target"))
    wait_s = sum(value(d, "specdec_rules_wait_seconds_total", job=job) for job in ("draft", "target"))
    accepted = sum(r["stats"].accepted_tokens for r in results)
    rejected = sum(r["stats"].rejected_rounds for r in results)
    return {
        "answers": results if grammar and k and mode == "greedy" else None,  # the fixed-K arm's
        **(judge(results) if grammar else {}),
        "alpha": leviathan_alpha(accepted, rejected) if k != 0 else None,
        "tokens_per_s": generated / wall,
        "rules_us_per_token": 1e6 * rules_s / generated,
        "target_rules_us_per_token": 1e6 * value(d, "specdec_rules_seconds_total", job="target") / generated,
        "rules_wait_us_per_token": 1e6 * wait_s / generated,
        "target_step_ms": 1e3 * mean_step_s(d, "target"),
    }


def same_text_agreement(draft: str, target: str, answers: list[dict]) -> dict:
    """The draft's greedy agreement with the target's answers under their grammars, teacher-forced in one pass each:
    with the draft's row masked by the grammar (as served) and unmasked. Greedy alpha on the same text, so the mask's
    own effect apart from what the answers say: unconstrained answers are other text (code fences, indentation)."""
    import torch

    from specdec import rule_book, rules
    from specdec.runners.vocab import output_token_ids

    tokenizer, model = models.load_tokenizer(target), models.load_model(draft)
    scored = output_token_ids(model)
    book = rule_book.RuleBook(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    hits = {"masked": 0, "unmasked": 0}
    total = 0
    for a in answers:
        chat = [{"role": "user", "content": a["prompt"]}]
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
        answer = a["ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1].float()  # [n, vocab]
        if scored is not None:  # the draft's restricted vocabulary, as its server scores it
            outside = torch.ones(logits.shape[1], dtype=torch.bool)
            outside[scored] = False
            logits[:, outside] = float("-inf")
        msg = ms_pb.OutputRules(
            output_start=len(prompt), grammar=ms_pb.Grammar(json_schema=json.dumps(SCHEMAS[a["name"]]))
        )
        state = rules.RuleState(book.check(msg), book.tokenizer, book.eos_ids)
        allowed = torch.from_numpy(state.allowed(prompt + answer, len(prompt), len(answer), len(tokenizer)).copy())
        want = torch.tensor(answer)
        hits["unmasked"] += int((logits.argmax(-1) == want).sum())
        hits["masked"] += int((logits.masked_fill(~allowed, float("-inf")).argmax(-1) == want).sum())
        total += len(answer)
    return {key: v / total for key, v in hits.items()} | {"tokens": total}


def one_run(address: str, urls: dict, auto: tuple, jobs, tokens: int, k: int, modes=tuple(MODES)) -> dict:
    out = {}
    for mode in modes:
        r = {
            "grammar_k": arm(address, urls, jobs, tokens, k, mode, True),
            "plain_k": arm(address, urls, jobs, tokens, k, mode, False),
            "grammar_k0": arm(address, urls, jobs, tokens, 0, mode, True),
            "grammar_auto": arm(*auto, jobs, tokens, None, mode, True),
        }
        step_us = 1e3 * r["grammar_k0"]["target_step_ms"]
        r["rules_share_of_step_k"] = r["grammar_k"]["rules_us_per_token"] / step_us if step_us else None
        r["rules_share_of_step_k0"] = r["grammar_k0"]["rules_us_per_token"] / step_us if step_us else None
        for k_arm in ("k", "k0"):  # what the calls waited for, the masks run beside the forward passes
            wait = r[f"grammar_{k_arm}"]["rules_wait_us_per_token"]
            r[f"rules_wait_share_of_step_{k_arm}"] = wait / step_us if step_us else None
        out[mode] = r
    return out


def spread(xs: list) -> dict | None:
    xs = [x for x in xs if x is not None]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None


def summarize(runs: list[dict]) -> dict:
    """Every figure of one_run as its spread over the reps."""
    out: dict = {}
    for mode, first in runs[0].items():
        out[mode] = {}
        for key, v in first.items():
            if isinstance(v, dict):
                out[mode][key] = {f: spread([r[mode][key][f] for r in runs]) for f in v}
            else:
                out[mode][key] = spread([r[mode][key] for r in runs])
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--target", default=models.DEFAULT_TARGET)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES), help=f"the sampling modes to run, of {','.join(MODES)}")
    p.add_argument("--out", default="results/structured")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if not modes or not set(modes) <= set(MODES):
        p.error(f"--modes takes some of {','.join(MODES)}, got {args.modes!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = list(enumerate((name, prompt) for name, prompts in PROMPTS.items() for prompt in prompts))
    procs, address, urls, auto, forwards = start_services(args.draft, args.target, out / "services.log")
    try:
        one_run(address, urls, auto, jobs[:2], 16, args.k, modes)  # warm-up: kernels, caches
        runs, answers = [], None
        for rep in range(args.reps):
            runs.append(one_run(address, urls, auto, jobs, args.tokens, args.k, modes))
            answers = runs[-1]["greedy"]["grammar_k"].pop("answers") if "greedy" in modes else None
            for mode in modes:
                for arm in runs[-1][mode].values():
                    if isinstance(arm, dict):
                        arm.pop("answers", None)
            print(f"rep {rep}: {json.dumps(runs[-1])}", flush=True)
    finally:
        stop_services(procs)
    agreement = same_text_agreement(args.draft, args.target, answers) if answers else None  # greedy's answers
    report = {"machine": machine(), "forwards": forwards, "schemas": len(SCHEMAS), "requests": len(jobs)}
    report.update(tokens=args.tokens, k=args.k, reps=args.reps, results=summarize(runs), same_text=agreement)
    return save(report, out, "structured")


if __name__ == "__main__":
    main()
