"""The grammar's masks checked on this machine before a server applies any: along a JSON answer, every row that the
server's own path masks (RuleState.masks, then the mask kernel) must allow only tokens the grammar engine's token
check accepts, and all of them where the grammar forces nothing (where it forces bytes, a mask keeps their canonical
tokens alone, grammar.best_allowed).

A mask that allows a token the grammar refuses breaks structured output silently: on an H100 machine's 16-core
Xeon (2026-11-27, docs/performance.md, item 41) the embedded target's greedy JSON answer took ':' where the grammar
forced ' "', and tests/test_rules.py's mask test failed there, while the same calls passed on three other CPUs. A
server whose masks fail this check refuses grammars with FAILED_PRECONDITION and says why, instead of answering out
of its grammar. The check costs about 0.1 s, once, at the first request with a grammar.
"""

from __future__ import annotations

import json
import logging

import grpc
import numpy as np
import torch

from specdec.errors import ServiceError
from specdec.grammar import JSON_FORM, allows, unpack

log = logging.getLogger(__name__)

PROBE_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array"}},
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PROBE_ANSWER = '{"name": "Ada Lovelace", "age": 36, "tags": ["math", 1843]}'
SAMPLE_EVERY = 29  # the tokens of a row token-checked: one in SAMPLE_EVERY of the vocabulary and of what the mask
ALL_ALLOWED = 1024  # allows, and every token it allows where it allows at most ALL_ALLOWED (a grammar's narrow rows)


def disagreement(book) -> str | None:
    """None when this server's masks agree with the grammar's token checks at every row of PROBE_ANSWER; else the
    first row and token where they differ, and which reading of the mask differs: the grammar engine's bits
    themselves, or the bits as the mask kernel applies them to a row (numpy's unpacking where the kernel is not
    built), or numpy's unpacking of them (RuleState.allowed). book: the server's RuleBook (tokenizer, vocabulary)."""
    import llguidance

    from specdec.rules import Rules, RuleState

    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(PROBE_SCHEMA), defaults=JSON_FORM)
    answer = book.hf_tokenizer.encode(PROBE_ANSWER, add_special_tokens=False)
    vocab, n = book.vocab_size, len(answer) + 1
    state = RuleState(Rules(output_start=0, grammar=grammar), book.tokenizer, book.eos_ids)
    packed = state.masks(answer, 0, n, vocab).copy()  # every row: the answer as one call's drafts
    columns = np.arange(vocab)
    bits = ((packed[:, columns >> 5] >> (columns & 31)) & 1).astype(bool)  # [n, vocab], read without unpackbits
    readings = {
        "the mask applied to a row": (
            state.apply(torch.zeros(n, vocab), answer, 0, vocab, packed=packed.copy()) > -np.inf
        ).numpy(),
        "numpy's unpacking of the mask": unpack(packed, vocab),
    }
    for name, reading in readings.items():
        wrong = np.argwhere(reading != bits)
        if len(wrong):
            i, t = wrong[0].tolist()
            return f"after {answer[:i]} {name} {'allows' if reading[i, t] else 'refuses'} token {t}, unlike its bits"
    checker = llguidance.LLMatcher(book.tokenizer, grammar)
    ends = frozenset(book.tokenizer.eos_tokens)
    sample = np.arange(0, vocab, SAMPLE_EVERY)
    for i in range(n):
        if not bits[i].any():
            return f"after {answer[:i]} the grammar engine's mask allows nothing"
        forced = bool(checker.compute_ff_bytes())  # there a mask keeps the grammar's canonical tokens alone
        kept = np.flatnonzero(bits[i])
        for t in np.union1d(kept if len(kept) <= ALL_ALLOWED else kept[::SAMPLE_EVERY], sample).tolist():
            accepted = allows(checker, t, ends)
            if bits[i, t] and not accepted:
                return f"after {answer[:i]} the grammar engine's mask allows token {t}, which the grammar refuses"
            if accepted and not bits[i, t] and not forced:
                return f"after {answer[:i]} the grammar engine's mask refuses token {t}, which the grammar accepts"
        if i < len(answer) and not checker.consume_token(answer[i]):
            return f"the grammar refuses its own probe answer at token {i}"
    return None


class Trust:
    """A server's verdict on its masks: checked at the first request with a grammar, then kept."""

    def __init__(self):
        self.checked, self.fault = False, None

    def require(self, book) -> None:
        """FAILED_PRECONDITION, naming the disagreement, where this server's masks failed the check."""
        if not self.checked:
            self.fault, self.checked = disagreement(book), True
            if self.fault:
                log.error("grammars are refused: this machine's masks disagree with the grammar engine: %s", self.fault)
            else:
                log.info("grammar masks checked against the grammar engine's token checks: they agree")
        if self.fault:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"structured output is off on this server: on this machine its grammar masks disagree with the "
                f"grammar engine ({self.fault})",
            )
