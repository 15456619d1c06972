"""The grammar engines' cost per generated token on this CPU, side by side: xgrammar against llguidance.

    python -m bench.grammar [--reps 5] [--batch 8]      (xgrammar: pip install xgrammar==0.2.8, not a requirement)

Each engine compiles the same JSON schemas for the embedded target's tokenizer, then walks a valid answer token by
token: at each token it fills the next-token bitmask, applies it to a row of logits, and accepts the token, as a
model server does for one row of a Verify. "alone" is one matcher; "batched" is --batch matchers filled together
(each engine's batched call), per token of each. Compile times are reported apart (a server caches them).
Ratios are taken within each rep, engines interleaved, with the spread over reps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec import models
from specdec.config import DEFAULT_TARGET

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "hobbies": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "age", "hobbies"],
        "additionalProperties": False,
    },
    "weather_call": {
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    },
}
ANSWERS = {
    "person": {"name": "Ada Lovelace", "age": 36, "hobbies": ["mathematics", "poetry", "analytical engines"]},
    "weather_call": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}},
}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int):
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab = vocab

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matchers(self, compiled, n: int):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def bitmask(self, n: int):
        return self.xgr.allocate_token_bitmask(n, self.vocab)

    def step(self, matchers, bitmask, logits, token: int) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)
        for m in matchers:
            assert m.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lt = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.vocab = vocab

    def compile(self, schema: dict):
        # the same separators as xgrammar's compact form: ", " and ": ", no other whitespace
        defaults = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        return self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)

    def matchers(self, compiled, n: int):
        return [self.llg.LLMatcher(self.tokenizer, compiled) for _ in range(n)]

    def bitmask(self, n: int):
        return self.lt.allocate_token_bitmask(n, self.vocab)

    def step(self, matchers, bitmask, logits, token: int) -> None:
        if len(matchers) == 1:
            self.lt.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            self.lt.fill_next_token_bitmask_par(self._executor(), [(m, i) for i, m in enumerate(matchers)], bitmask)
        self.lt.apply_token_bitmask_inplace(logits, bitmask)
        for m in matchers:
            assert m.consume_token(token), m.get_error()

    def _executor(self):
        if not hasattr(self, "executor"):
            self.executor = self.llg.LLExecutor(1)
        return self.executor


def walk(engine, compiled, tokens: list[int], n: int) -> float:
    """Seconds per token of n matchers walking the tokens together (mask, apply, accept)."""
    matchers = engine.matchers(compiled, n)
    bitmask = engine.bitmask(n)
    logits = torch.randn(n, engine.vocab)
    t0 = time.perf_counter()
    for t in tokens:
        engine.step(matchers, bitmask, logits, t)
    return (time.perf_counter() - t0) / len(tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    tokenizer = models.load_tokenizer(DEFAULT_TARGET)
    vocab = len(tokenizer)
    engines = [LLGuidance(tokenizer, vocab)]
    try:
        engines.insert(0, XGrammar(tokenizer, vocab))
    except ImportError:
        print("xgrammar is not installed: llguidance alone")
    result = {"vocab": vocab, "compile_s": {}, "per_token_us": {}}
    compiled = {}
    for e in engines:
        for name, schema in SCHEMAS.items():
            t0 = time.perf_counter()
            compiled[e.name, name] = e.compile(schema)
            result["compile_s"][f"{e.name}/{name}"] = round(time.perf_counter() - t0, 4)
    answers = {name: tokenizer.encode(json.dumps(a), add_special_tokens=False) for name, a in ANSWERS.items()}
    times: dict[str, list[float]] = {}
    for rep in range(args.reps + 1):  # the first rep warms the engines' caches and is not counted
        for name, tokens in answers.items():
            for n, label in ((1, "alone"), (args.batch, f"batch{args.batch}")):
                for e in engines:
                    per_token = walk(e, compiled[e.name, name], tokens, n) / n
                    if rep:
                        times.setdefault(f"{e.name}/{name}/{label}", []).append(per_token * 1e6)
    for key, xs in sorted(times.items()):
        result["per_token_us"][key] = {
            "median": round(statistics.median(xs), 1),
            "min": round(min(xs), 1),
            "max": round(max(xs), 1),
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
