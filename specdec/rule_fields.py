"""A generation's output rules as a model server takes them from specdec.v1.OutputRules: checked, and None where
they change nothing. What each rule does to a row, and in which order, is specdec/rules.py's."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from specdec.errors import invalid
from specdec.grammar import grammar_text

MAX_BIAS = 100.0


@dataclass(frozen=True)
class Rules:
    """One generation's rules, checked (from specdec.v1.OutputRules)."""

    output_start: int
    grammar: str | None = None
    bias: tuple[tuple[int, float], ...] = ()
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    min_tokens: int = 0
    blocked: tuple[int, ...] = ()

    # the two below are read at every row of every call, after a forward pass has left the caches cold: computed once
    @functools.cached_property
    def counts_tokens(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1.0)

    @functools.cached_property
    def has_edits(self) -> bool:
        """Whether any rule but the grammar changes a row (bias, penalties, min_tokens)."""
        return bool(self.bias or self.counts_tokens or self.blocked)


def from_proto(msg, vocab_size: int) -> Rules | None:
    """The rules of a request's OutputRules, or None where they change nothing; INVALID_ARGUMENT when out of range."""
    if msg is None:
        return None
    bias = tuple(sorted((int(t), float(b)) for t, b in msg.logit_bias.items() if b))
    tokens = [t for t, _ in bias] + list(msg.min_tokens_blocked)
    if any(t >= vocab_size for t in tokens):
        raise invalid(f"a token id of the rules is outside the vocabulary of {vocab_size}")
    if any(not abs(b) <= MAX_BIAS for _, b in bias):
        raise invalid(f"logit_bias values must be within [-{MAX_BIAS:g}, {MAX_BIAS:g}]")
    if not (abs(msg.presence_penalty) <= 2 and abs(msg.frequency_penalty) <= 2):
        raise invalid("presence_penalty and frequency_penalty must be within [-2, 2]")
    repetition = msg.repetition_penalty or 1.0
    if not 0 < repetition < float("inf"):
        raise invalid(f"repetition_penalty must be a finite number > 0, got {msg.repetition_penalty}")
    rules = Rules(
        output_start=msg.output_start,
        grammar=grammar_text(msg.grammar) if msg.HasField("grammar") else None,
        bias=bias,
        presence=msg.presence_penalty,
        frequency=msg.frequency_penalty,
        repetition=repetition,
        min_tokens=msg.min_tokens,
        blocked=tuple(msg.min_tokens_blocked) if msg.min_tokens else (),
    )
    if rules == Rules(output_start=msg.output_start):
        return None
    return rules
