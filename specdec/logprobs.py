"""The target's raw log-probabilities for a Verify that asks for them (VerifyRequest.logprobs).

Raw means log_softmax of the logits at temperature 1, before top-k, top-p or any mask (vLLM's default
``logprobs_mode``): what a client's logprobs report is the model's view of a token, not the sampler's. A Verify
returns the log-probability of each draft token at its row and each row's most likely tokens; the session keeps
the rows (``LogprobRows``) until its next call, so that the orchestrator can ask for a recovered or bonus token
it drew outside them (GetLogprobs) without another forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import torch

from specdec.errors import ServiceError, invalid
from specdec.v1 import target_pb2

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax at temperature 1, in float32 on the CPU. logits: [n, vocab] -> [n, vocab]."""
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def top_tokens(logprobs: torch.Tensor, n: int) -> list[tuple[list[int], list[float]]]:
    """Each row's n most likely tokens, most likely first and ties by ascending id: (ids, log-probs) per row.
    logprobs: [rows, vocab]."""
    if n <= 0:
        return [([], []) for _ in range(logprobs.shape[0])]
    values, ids = torch.topk(logprobs, min(n, logprobs.shape[-1]), dim=-1)  # [rows, n], descending
    out = []
    for v, i in zip(values.tolist(), ids.tolist()):
        ranked = sorted(zip(v, i), key=lambda pair: (-pair[0], pair[1]))
        out.append(([t for _, t in ranked], [lp for lp, _ in ranked]))
    return out


def at(logprobs: torch.Tensor, token_ids: list[int]) -> list[float]:
    """The log-probability of token_ids[i] in row i. logprobs: [>= len(token_ids), vocab]."""
    rows = torch.arange(len(token_ids))
    return logprobs[rows, torch.tensor(token_ids, dtype=torch.long)].tolist()


@dataclass(frozen=True)
class LogprobRows:
    """A session's raw log-prob rows of its last Verify that asked for them: rows[i] scores position start + i."""

    start: int
    rows: torch.Tensor  # [K+1, vocab] float32

    def lookup(self, position: int, token_ids: list[int]) -> list[float] | None:
        """The log-probabilities of token_ids at position; None when no row holds it."""
        i = position - self.start
        if not 0 <= i < self.rows.shape[0]:
            return None
        return self.rows[i, torch.tensor(token_ids, dtype=torch.long)].tolist()


def check(req: target_pb2.VerifyRequest) -> None:
    """Refuse a Verify's logprob fields before it feeds anything; raises INVALID_ARGUMENT."""
    if req.top_logprobs > MAX_TOP_LOGPROBS:
        raise invalid(f"top_logprobs must be within [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}")
    if req.top_logprobs and not req.logprobs:
        raise invalid("top_logprobs needs logprobs")
    if req.prompt_logprobs and not req.logprobs:
        raise invalid("prompt_logprobs needs logprobs")


def fill(resp: target_pb2.VerifyResponse, logits: torch.Tensor, drafts: list[int], top: int, start: int) -> LogprobRows:
    """Set a Verify's draft_token_logprobs and top_logprobs; returns the rows for its session to keep.
    logits: [K+1, vocab], row i scoring position start + i; drafts: [K]."""
    rows = raw_logprobs(logits)  # [K+1, vocab]
    resp.draft_token_logprobs.extend(at(rows, drafts))
    for ids, values in top_tokens(rows, top):
        resp.top_logprobs.add(token_ids=ids, logprobs=values)
    return LogprobRows(start, rows)


def fill_prompt(resp: target_pb2.VerifyResponse, logits: torch.Tensor, tokens: list[int], top: int) -> None:
    """Set a Verify's prompt_token_logprobs and prompt_top_logprobs (VerifyRequest.prompt_logprobs).
    logits: [len(tokens), vocab], row i scoring tokens[i]."""
    rows = raw_logprobs(logits)  # [len(tokens), vocab]
    resp.prompt_token_logprobs.extend(at(rows, tokens))
    for ids, values in top_tokens(rows, top):
        resp.prompt_top_logprobs.add(token_ids=ids, logprobs=values)


def fill_bonus(resp: target_pb2.VerifyResponse, kept: LogprobRows | None) -> None:
    """bonus_token_logprob, where the Verify asked for logprobs and drew the bonus token."""
    if kept is not None and resp.HasField("bonus_token_id"):
        resp.bonus_token_logprob = kept.lookup(kept.start + kept.rows.shape[0] - 1, [resp.bonus_token_id])[0]


def answer(kept: LogprobRows | None, req: target_pb2.GetLogprobsRequest, vocab: int) -> target_pb2.GetLogprobsResponse:
    """GetLogprobs on a session that keeps `kept`; raises NOT_FOUND where no kept row scores the position."""
    if any(t >= vocab for t in req.token_ids):
        raise invalid(f"token ids must be below the vocabulary size {vocab}")
    found = kept.lookup(req.position, list(req.token_ids)) if kept is not None else None
    if found is None:
        raise ServiceError(
            grpc.StatusCode.NOT_FOUND,
            f"position {req.position} has no log-probabilities from the last Verify of {req.session_id!r} "
            "(it did not set logprobs, or another call came since)",
        )
    return target_pb2.GetLogprobsResponse(logprobs=found)
