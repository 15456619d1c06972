"""A request's output rules (structured output, logit_bias, penalties, min_tokens) as the model servers apply them.

The orchestrator checks them once, when the request arrives, with the same checks and the same grammar engine as
the model servers (specdec/rules.py), so a bad schema or bias is INVALID_ARGUMENT before any KV is taken; then it
sends the same OutputRules on every Verify and ProposeTokens of the generation.
"""

from __future__ import annotations

from specdec import rule_book, rules
from specdec.errors import invalid
from specdec.v1 import generation_pb2 as gen_pb, model_server_pb2 as ms_pb


class RuleChecker:
    """The orchestrator's side of the rules: the grammar engine's tokenizer (built on first use) and the checks."""

    def __init__(self, tokenizer, eos_ids: set[int]):
        self.book = rule_book.RuleBook(tokenizer, len(tokenizer), sorted(eos_ids))

    def of(self, req: gen_pb.GenerateRequest, prompt_length: int) -> ms_pb.OutputRules | None:
        """The OutputRules of a request whose prompt holds prompt_length tokens, checked; None when it sets none."""
        msg = ms_pb.OutputRules(
            output_start=prompt_length,
            logit_bias=dict(req.logit_bias),
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty if req.HasField("repetition_penalty") else 0.0,
            min_tokens=req.min_tokens,
        )
        if req.HasField("repetition_penalty") and not req.repetition_penalty > 0:
            raise invalid(f"repetition_penalty must be > 0 (1 is none), got {req.repetition_penalty}")
        if req.HasField("grammar") and req.grammar.WhichOneof("kind") is not None:
            if req.ignore_eos:
                raise invalid("a grammar ends the output with an end-of-sequence token: it cannot go with ignore_eos")
            msg.grammar.CopyFrom(req.grammar)
        if req.min_tokens:
            blocked = set(req.stop_token_ids) | (set() if req.ignore_eos else set(self.book.eos_ids))
            msg.min_tokens_blocked.extend(sorted(blocked))
        if self.book.check(msg) is None:
            return None
        return msg

    def grammar(self, msg: ms_pb.OutputRules | None) -> rules.RuleState | None:
        """A generation's own grammar state, which cuts prompt-lookup proposals at the first token the grammar
        refuses (the draft model's proposals follow the grammar already); None without a grammar."""
        checked = self.book.check(msg)
        if checked is None or checked.grammar is None:
            return None
        return rules.RuleState(checked, self.book.tokenizer, self.book.eos_ids)
